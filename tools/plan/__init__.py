"""`tandem plan`: capacity planning by simulation (docs/reference/plan.md)."""
