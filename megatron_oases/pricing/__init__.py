"""What the planner and the simulator share to price a description: the device model and profile
DB (``device_model``), the event record and the collective group class (``event``)."""
