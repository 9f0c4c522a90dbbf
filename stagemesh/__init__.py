"""stagemesh: the command line and the model store shared by every service."""

__version__ = "0.1.0"
