"""One-off GPU checks of the engine (dispatch, throughput, Mosaic agreement, tensor parallel);
their results are in lab/results/ and, for the product figures they produced, in
benchmarks/results/."""
