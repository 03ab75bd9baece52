"""Local ``evaluate`` metrics, loaded offline by path (``evaluate.load(<folder>)``): ``<folder>/<folder>.py``."""
