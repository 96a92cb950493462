"""Adaptive choices (Tutel 3.3): the tuning dictionary that picks the fastest equivalent setting."""
from weft.tune.dictionary import Setting, TuningDictionary, run_until_tuned, tuned_seconds

__all__ = ["Setting", "TuningDictionary", "run_until_tuned", "tuned_seconds"]
