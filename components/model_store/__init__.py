"""Embedding models from any source (this project's, torchvision, ONNX, MLflow), their preprocessing,
and the MLflow model folder every registered version is."""
