"""The scheduler side: ``manager`` (the Manager), ``policies`` (LRU, ARC and the policy seam),
``records`` (plans, events, statistics), ``state`` (per-key entries and per-tier pools). Imports
neither torch nor CUDA."""
