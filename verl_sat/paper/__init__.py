"""The paper's experiment: the grid of Table-1 cells, Table 1 as data, and the report that puts
runs beside it (docs/reproduce.md)."""
