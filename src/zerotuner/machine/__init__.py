"""What the host offers: GPUs, memory, the NVIDIA driver, DeepSpeed's ops, the NVMe volume."""
