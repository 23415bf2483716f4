"""Once per node, before the ranks: the model, the plan, the DeepSpeed config."""
