"""The out-of-core optimizer: parameter groups whose fp32 master weights and optimizer
moments live on the SSD array, stepped on the CPU by the daemon."""
