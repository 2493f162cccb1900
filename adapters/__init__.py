"""Adapters that plug graphslot into training frameworks."""
