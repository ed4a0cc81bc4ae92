"""The run on Ray: the driver's loop (driver), the actors it starts and calls (workers), the overlap of generation with
learning (overlap), the precision ladder (ladder), live control (control) and Ray placement (placement)."""
