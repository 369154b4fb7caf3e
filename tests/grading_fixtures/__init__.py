"""Realistic wrong answers, per chapter and exercise: each must be rejected by the exercise's checks."""

REFUSED = "write it yourself"
"""What a refusal by an exercise's allow-list says (``course_lib.grading.allowlist.refusal_message``): a fixture here
is rejected for being wrong, never refused for the library objects it uses (that would prove nothing about the
checks)."""
