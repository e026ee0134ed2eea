"""Typed settings: pydantic models whose fields carry their one default and their description, and the environment variables, each declared once."""
