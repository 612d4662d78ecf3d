"""Training backends behind one interface: `train_stage(method, optimizer, epochs, ...)`."""
