"""Capacity planner: trends, profiles, forecasts and sizing of the prefill and decode pools. No HTTP here."""
