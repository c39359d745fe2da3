"""Model building blocks (nn.Modules) over the ops in dsv4cp.ops."""
