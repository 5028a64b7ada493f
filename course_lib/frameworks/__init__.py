"""A learner's own configuration, read into the course's job description (course_lib.job.Job).

    read_config("train.toml", num_gpus=8)                       # torchtitan
    read_config("pretrain_gpt.sh", num_gpus=64)                 # Megatron-LM's arguments, from a launch script
    read_config("ds_config.json", num_gpus=8, model="config.json", seq_len=4096)   # DeepSpeed, with a HF config.json

Each reader (torchtitan.py, megatron.py, deepspeed.py; huggingface.py for the model) knows its framework's
documented keys and conventions, and returns a :class:`ReadConfig`: the Job, what the framework does that the
course counts its own way (``conventions``), the keys it read but does not model (``not_modelled``: offload, FP8,
...: named, never silently dropped), and the keys it does not know (``unknown``, each with the nearest known
one). A file that contradicts itself (degrees whose product is not the GPU count, a batch that does not divide)
raises :class:`ConfigError`: one line naming the values and the rule.

The report on the job (memory of the busiest GPU, bytes per axis, step time, better layouts written back in the
framework's own keys) is course_lib.job_report's.
"""

from __future__ import annotations

from pathlib import Path

from ..runtime.arguments import MAX_VIRTUAL_WORLD
from .common import ConfigError, NotWritable, ReadConfig, whole
from .deepspeed import read as read_deepspeed
from .megatron import read as read_megatron
from .torchtitan import read as read_torchtitan

__all__ = ["EXAMPLES", "ConfigError", "NotWritable", "ReadConfig", "read_config"]
EXAMPLES = Path(__file__).with_name("examples")   # a few files of each framework (and Hugging Face config.json)


def read_config(path, *, num_gpus: int | None = None, gpu: str = "H100 SXM", gpus_per_node: int = 8,
                model: str | None = None, seq_len: int | None = None) -> ReadConfig:
    """The job in ``path``: a .toml is torchtitan's, a .json DeepSpeed's (with ``model``: a Hugging Face config.json
    or a course preset; ``seq_len``: its tokens per sequence, which DeepSpeed's config does not hold), anything else
    a Megatron-LM launch script or argument list. ``num_gpus``: the world, where the file leaves it open
    (torchtitan's -1, DeepSpeed's batch arithmetic)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{path}: cannot be read ({error.strerror or error})") from None
    if num_gpus is not None and whole("--gpus", num_gpus) > MAX_VIRTUAL_WORLD:
        raise ConfigError(f"--gpus {num_gpus:,}: more than the {MAX_VIRTUAL_WORLD:,} GPUs the virtual cluster runs "
                          "(course_lib.runtime.arguments.MAX_VIRTUAL_WORLD)")
    whole("--gpus-per-node", gpus_per_node)
    cluster = {"num_gpus": num_gpus, "gpu": gpu, "gpus_per_node": gpus_per_node}
    if path.suffix == ".toml":
        reader = read_torchtitan
    elif path.suffix == ".json":
        reader = read_deepspeed
        cluster.update(model=model, seq_len=seq_len)
    else:
        reader = read_megatron
    outside = [name for name, value in (("--model", model), ("--seq-len", seq_len)) if value is not None]
    if outside and reader is not read_deepspeed:
        raise ConfigError(f"{' and '.join(outside)}: only a DeepSpeed config takes the model and the sequence from "
                          f"outside; a {reader.__module__.split('.')[-1]} file names its own")
    read = reader(text, str(path), **cluster)
    if read.job.mesh.size > MAX_VIRTUAL_WORLD:   # a world the file itself states (torchrun's --nnodes)
        raise ConfigError(f"{read.job.mesh.size:,} GPUs: more than the {MAX_VIRTUAL_WORLD:,} the virtual cluster runs")
    return read
