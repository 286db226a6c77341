"""Model families: one file per family plus shared layers."""
