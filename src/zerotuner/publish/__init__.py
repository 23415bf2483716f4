"""Outputs that outlive the machine: S3 and Hub remotes, the model card."""
