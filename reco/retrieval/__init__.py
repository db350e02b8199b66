"""Retrieval as a stage: a two-tower model (two_tower), FAISS indexes as levers (ann), their front (front)."""
