"""The ``mcq_accuracy`` metric; load it with ``evaluate.load(<this folder>)``, not by importing it."""
