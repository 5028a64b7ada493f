"""Ready-made runs: the functions that notebooks, labs, tests and benchmarks hand to ``launch``.

Each technique module (ddp, zero, tensor_parallel, pipeline_parallel, mesh) holds its algorithm only; the
experiments around it live here: build the course model on each rank, apply the technique, train a few
steps, trace what is sent, time what is timed, and return what the caller plots or asserts. They are
harnesses, not ideas: read the technique module first.
"""
