"""PyTorch references: the contract of every operator, one module per family. Plain and readable."""
