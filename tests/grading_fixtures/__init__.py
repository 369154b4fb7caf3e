"""Realistic wrong answers, per chapter and exercise: each must be rejected by the exercise's checks."""
