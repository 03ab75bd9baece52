"""Local ``evaluate`` metric modules, loaded by path (``evaluate.load(<folder>)``, offline): one folder per metric,
holding ``<folder name>.py``."""
