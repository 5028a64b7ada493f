"""Units of memory, in one place. GiB = 2**30 bytes (what the source material and nvidia-smi use), GB = 10**9
bytes (what papers and spec sheets often use). Every printed number in the course says which."""

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
GB = 10**9
