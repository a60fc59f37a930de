"""Checkpoints: the on-disk store (``store``), the weight-delta format (``delta``), writing and loading
checkpoint folders (``files``), and the base model and registration of folders (``publish``)."""
