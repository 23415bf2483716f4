"""zerotuner: a containerized DeepSpeed fine-tuning appliance for diffusion models."""

__version__ = "0.1.0"
