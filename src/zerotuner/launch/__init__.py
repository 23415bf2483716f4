"""Starting this node's ranks, the job handed to them, and what they report back."""
