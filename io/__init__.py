"""kvtier.io: the NVMe tier (row format, RowIO backends, segment files, index)."""
