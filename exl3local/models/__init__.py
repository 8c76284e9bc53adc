"""Models on disk (what a model argument means, the records of complete pulls, the demo) and on the hub."""
