"""The machinery under ``launch`` and ``%%ranks``: worker processes, the world that stays between cells, the
magics, what a learner reads when ranks fail, the checked command-line values, and files written whole
(files.write_atomically). Not an idea of the course: the notebooks call it, the technique modules never do."""
