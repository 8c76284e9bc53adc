"""The dashboard's panels. Each owns reactive state that the app sets; each redraws itself."""
