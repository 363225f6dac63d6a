"""Layer 5, tools: the command line, the bench and the chunk search, pictures, the model of the
paper's machines, the demo and training. Nothing in the library imports them."""
