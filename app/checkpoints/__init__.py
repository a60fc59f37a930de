"""Checkpoints: the on-disk store (``store``), writing and loading
checkpoint folders (``files``), and the base model and registration of folders (``publish``)."""
