"""The driver: what runs on the launching machine, from the config to the step loop."""
