"""The inference seam: the engine interface every caller of a model depends on (``engine``) and the
torch device a setting names (``device``). Implementations live in ``serving``."""
