"""What a rank leaves behind for hang detection: its stack on demand, its pulse, NCCL's flight recorder."""
