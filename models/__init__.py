"""Training models (3DGAN, ResNet50): filled in by the training-engine issue."""
