"""ember's Hydra launcher plugins (see ray_launcher.py)."""
