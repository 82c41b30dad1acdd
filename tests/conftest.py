
import torch

# Tiny models run fastest single-threaded, and a shared 2-core machine punishes oversubscription.
torch.set_num_threads(1)
