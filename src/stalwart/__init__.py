"""stalwart: keeps large PyTorch training jobs training through failures."""

__version__ = "0.1.0"
