"""The tiny demo pipelines and dataset behind `make run` and the tests."""
