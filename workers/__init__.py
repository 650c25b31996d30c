"""The pipeline's stages: render, schedule, derender."""
