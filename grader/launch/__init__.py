"""Launching torchrun jobs and supervising them until every planned test has a verdict."""
