"""The machinery under ``launch`` and ``%%ranks``: worker processes, the world that stays between cells, the
magics, what a learner reads when ranks fail, and the checked command-line values. Not an idea of the course:
the notebooks call it, the technique modules never do."""
