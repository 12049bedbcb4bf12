"""Routing knowledge: how prefixes are named, announced, recorded and scored."""
