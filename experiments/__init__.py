"""Researchers' own experiments, loaded by the runner through `_target_: experiments.<module>.<Class>`."""
