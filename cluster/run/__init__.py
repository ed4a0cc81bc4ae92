"""The run on Ray: the driver's loop (driver), the actors it starts and calls (workers), where each step's rollouts
come from (supply, stream), the precision ladder (ladder), live control (control) and Ray placement (placement)."""
