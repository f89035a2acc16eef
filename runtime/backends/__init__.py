"""What runs the step graph: onnxruntime (:mod:`.onnx`), TensorRT (:mod:`.trt`), and
:mod:`.loading`, which opens a bundle directory, its ONNX file or its engine as a backend."""
