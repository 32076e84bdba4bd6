"""Several GPUs in one box: one runner, a process per GPU, experts spread over them.

Rank 0 is the runner process; it runs the dense layers and attention and owns the KV
cache. Every rank (rank 0 included) owns a block of every MoE layer's experts: their host
banks, and its GPU's expert cache. Each experts op is one operation of the whole group
(`experts.DistributedExperts`); model files see only the experts op. See the "Several GPUs"
section of docs/architecture.md.
"""

from freetoken.dist.group import Group, RankDied, devices, launch, share, use

__all__ = ["Group", "RankDied", "devices", "launch", "share", "use"]
