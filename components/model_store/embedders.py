"""A team's embedding models behind the interface the upgrade embeds with.

Every embedder here is a torch module whose forward takes a float batch of pixels / 255 in its
own (N, C, H, W) (what ``components.experiment.inference.embed`` feeds any model) and returns
one embedding per image. Each carries its ``preprocessing`` (``components.model_store.preprocessing``),
its ``embedding_dim``, and a ``classifier`` over its own classes or None. A team's classes are
not the gallery's labels, so ``class_index`` knows none of them: the map's discriminative term
then trains on the head's predicted classes (``components.gallery.upgrade.pairs``).

- ``TorchvisionEmbedder``: any architecture ``torchvision.models.get_model`` builds, with the
  team's weights, the embedding read at a named layer (default: the input of the last linear
  layer, i.e. what feeds the classifier, which is then kept as the head);
- ``OnnxEmbedder``: an ONNX graph run by onnxruntime (CUDA provider when there is a GPU);
- ``ModuleEmbedder``: a trusted torch module from an MLflow ``pytorch`` flavour (its output is
  the embedding).
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch import nn

from fastfill.components.experiment import vision
from fastfill.components.model_store.preprocessing import Preprocessing


class ModelSourceError(ValueError):
    """A model file or description that cannot be used: the message says what to fix."""


class ForeignEmbedder(nn.Module):
    """What the upgrade needs of a model this project did not train."""

    source = "foreign"

    def __init__(self, preprocessing: Preprocessing):
        super().__init__()
        self.preprocessing = preprocessing
        self.embedding_dim = 0  # set by ``probe`` once an output was seen
        self.classifier: nn.Module | None = None

    def class_index(self, labels: torch.Tensor) -> torch.Tensor:
        """No gallery label is a class of a team's own head: -1 for each."""
        return torch.full_like(labels, -1)

    def probe(self, batch: int = 2) -> int:
        """Run ``batch`` images of the model's shape through it; sets and returns the embedding
        size. A ModelSourceError says what is wrong with an output that is not one finite vector
        per image."""
        generator = torch.Generator().manual_seed(0)
        pixels = torch.rand((batch, *self.preprocessing.shape), generator=generator)
        try:
            with torch.no_grad():
                out = self.embed_pixels(pixels)
        except ModelSourceError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever the framework raised, said in one line
            raise ModelSourceError(f"the model failed on a probe batch of {batch} images of "
                                   f"{self.preprocessing.describe()}: {type(error).__name__}: "
                                   f"{str(error).splitlines()[0] if str(error) else ''}"[:600]) from error
        if out.ndim != 2 or out.shape[0] != batch:
            raise ModelSourceError(f"the model returned shape {tuple(out.shape)} for {batch} images; it must return "
                                   f"one vector per image, ({batch}, d): name the embedding layer or output")
        if not torch.isfinite(out).all():
            raise ModelSourceError("the model returned non-finite values (NaN or inf) on a probe batch: check its "
                                   "weights and its preprocessing's mean and std")
        self.embedding_dim = int(out.shape[1])
        if self.classifier is not None:
            logits = self.classifier(out)
            if logits.ndim != 2 or not torch.isfinite(logits).all():
                self.classifier = None
        return self.embedding_dim

    def embed_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.embed_pixels(pixels)

    def classify(self, features: torch.Tensor) -> torch.Tensor:
        if self.classifier is None:
            raise ValueError("this model has no classifier head")
        return self.classifier(features)


class _Captured(Exception):
    """Raised by a hook to stop the forward pass at the embedding layer."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value


def pool(output) -> torch.Tensor:
    """A layer's output as one vector per image: (N, C, H, W) averaged over space, (N, T, D) token
    sequences by their first (class) token, (N, D, 1, ...) flattened."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ModelSourceError(f"the embedding layer returned {type(output).__name__}, not a tensor")
    if output.ndim == 4:
        return output.mean(dim=(2, 3))
    if output.ndim == 3:
        return output[:, 0]
    return output.flatten(1)


def last_linear(net: nn.Module) -> str | None:
    """The name of the last ``nn.Linear`` in ``net`` (its classifier, for torchvision's models)."""
    names = [name for name, module in net.named_modules() if isinstance(module, nn.Linear)]
    return names[-1] if names else None


class ModuleEmbedder(ForeignEmbedder):
    """A torch module whose embedding is read at ``layer`` (its output) or, with ``layer`` None,
    at the input of ``head`` (the last linear layer, kept as the classifier) or, with neither,
    the module's own output."""

    source = "torch"

    def __init__(self, net: nn.Module, preprocessing: Preprocessing, layer: str | None = None,
                 head: str | None = None):
        super().__init__(preprocessing)
        self.net = net.eval()
        self.layer, self.head = layer, head
        modules = dict(net.named_modules())
        where = layer if layer is not None else head
        if where is not None and where not in modules:
            known = ", ".join(name for name in modules if name)[:400]
            raise ModelSourceError(f"the model has no layer {where!r}; its layers: {known}")
        # The hooks act only inside embed_pixels (the head is called on its own too), and only in the
        # thread whose embed_pixels is running: chunks embed with one model from several threads at
        # once, and one flag for all of them let a finishing chunk switch off another's capture.
        self._capturing = threading.local()
        if where is not None:
            capture = modules[where]
            # bound methods, not closures: a copy of the embedder gets hooks bound to the copy
            if layer is not None:
                capture.register_forward_hook(self._capture_output)
            else:
                capture.register_forward_pre_hook(self._capture_input)
                self.classifier = modules[head]

    def __getstate__(self):  # a thread-local does not pickle or copy: each copy gets its own
        state = dict(super().__getstate__())
        state.pop("_capturing", None)
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._capturing = threading.local()

    def _capture_output(self, _module, _inputs, output) -> None:
        self._capture(output)

    def _capture_input(self, _module, inputs) -> None:
        self._capture(inputs[0])

    def _capture(self, value) -> None:
        if getattr(self._capturing, "active", False):
            raise _Captured(pool(value))

    def embed_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.preprocessing.normalise(pixels.float() if pixels.dtype == torch.uint8 else pixels)
        if self.layer is None and self.head is None:
            return pool(self.net(x))
        self._capturing.active = True
        try:
            self.net(x)
        except _Captured as captured:
            return captured.value
        finally:
            self._capturing.active = False
        raise ModelSourceError(f"the forward pass never reached layer {self.layer or self.head!r}")


class TorchvisionEmbedder(ModuleEmbedder):
    source = "torchvision"

    def __init__(self, architecture: str, state: dict, preprocessing: Preprocessing, layer: str | None = None):
        net = build_torchvision(architecture, state)
        head = None if layer is not None else last_linear(net)
        super().__init__(net, preprocessing, layer, head)
        self.architecture_name = architecture


def build_torchvision(architecture: str, state: dict) -> nn.Module:
    """``torchvision.models.get_model(architecture)`` with ``state`` loaded: the classifier's
    size taken from the weights (a team's fine-tuned head rarely has 1,000 classes)."""

    names = vision.torchvision.models.list_models()
    if architecture not in names:
        import difflib

        close = difflib.get_close_matches(architecture, names, n=4, cutoff=0.6)
        raise ModelSourceError(f"torchvision has no architecture {architecture!r}"
                               + (f"; did you mean one of {', '.join(close)}?" if close else
                                  "; `python -c 'import torchvision; print(torchvision.models.list_models())'` "
                                  "lists them"))
    kwargs = {}
    net = vision.torchvision.models.get_model(architecture, weights=None)
    head = last_linear(net)
    if head is not None and f"{head}.weight" in state:
        rows = int(state[f"{head}.weight"].shape[0])
        if rows != dict(net.named_modules())[head].out_features:
            kwargs["num_classes"] = rows
            net = vision.torchvision.models.get_model(architecture, weights=None, **kwargs)
    mismatch = state_mismatch(net.state_dict(), state)
    if mismatch:
        raise ModelSourceError(f"the weights do not fit torchvision's {architecture}: {mismatch}; check the "
                               "architecture name (and that the file holds that network's state dict)")
    net.load_state_dict(state)
    return net.eval()


def state_mismatch(expected: dict, given: dict) -> str | None:
    """What keeps ``given`` from loading into a network whose state dict is ``expected``, said
    in a few words (counts and the first of each kind), or None when it fits."""
    missing = [key for key in expected if key not in given]
    unexpected = [key for key in given if key not in expected]
    shapes = [f"{key} is {tuple(given[key].shape)}, the network's {tuple(value.shape)}"
              for key, value in expected.items() if key in given and tuple(given[key].shape) != tuple(value.shape)]
    said = []
    if missing:
        said.append(f"{len(missing)} of its {len(expected)} tensors missing (first {missing[0]})")
    if unexpected:
        said.append(f"{len(unexpected)} tensors it does not have (first {unexpected[0]})")
    if shapes:
        said.append(f"{len(shapes)} of other shapes (first {shapes[0]})")
    return "; ".join(said) or None


def read_state_dict(path) -> dict:
    """A state dict from safetensors, or from a torch file read with ``weights_only=True``
    (tensors only: a pickled module or code in it is refused, never run)."""
    import pickle
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise ModelSourceError(f"no weights file {path}")
    head = path.read_bytes()[:8]
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError) as error:
            raise ModelSourceError(f"{path} is not a safetensors file: {error}") from error
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as error:
        if not head.startswith(b"PK"):
            raise ModelSourceError(f"{path} is not a torch file (nor .safetensors): save the weights with "
                                   "torch.save(model.state_dict(), ...) or safetensors") from error
        raise ModelSourceError(f"{path} holds pickled objects besides tensors (a whole module?), and loading those "
                               "runs code: it was not loaded. Save the state dict instead: "
                               "torch.save(model.state_dict(), ...) or safetensors") from error
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelSourceError(f"{path} holds {type(state).__name__}, not a state dict of tensors")
    return state


class OnnxEmbedder(ForeignEmbedder):
    """An ONNX graph (bytes), images in (float32 after the preprocessing's scaling), embeddings
    out (``output``: its name; default the graph's first output)."""

    source = "onnx"
    channels_last = False  # onnxruntime takes (N, C, H, W) as laid out: no reordering on the way

    def __init__(self, graph: bytes, preprocessing: Preprocessing, output: str | None = None,
                 threads: int | None = None):
        super().__init__(preprocessing)
        self.session = onnx_session(graph, threads)
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise ModelSourceError(f"the ONNX graph takes {len(inputs)} inputs "
                                   f"({', '.join(i.name for i in inputs)}); it must take one: the images")
        self.input_name = inputs[0].name
        self.input_type = inputs[0].type
        outputs = [o.name for o in self.session.get_outputs()]
        if output is not None and output not in outputs:
            raise ModelSourceError(f"the ONNX graph has no output {output!r}; its outputs: {', '.join(outputs)}")
        self.output_name = output or outputs[0]
        check_onnx_input(inputs[0].shape, preprocessing)
        self._dtype = np.float16 if self.input_type == "tensor(float16)" else np.float32
        # pixels * scale + shift == (pixels / 255 - mean) / std, per channel
        std = np.asarray(preprocessing.std, dtype=np.float64).reshape(1, -1, 1, 1)
        mean = np.asarray(preprocessing.mean, dtype=np.float64).reshape(1, -1, 1, 1)
        self._scale = (1.0 / (255.0 * std)).astype(self._dtype)
        self._shift = (-mean / std).astype(self._dtype)
        self.pixels_session = None
        pixels_graph = with_pixel_input(graph, self.input_name, self._scale, self._shift)
        if pixels_graph is not None:
            self.pixels_session = onnx_session(pixels_graph, threads)

    def embed_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels / 255 as a torch batch (the interface every embedder has)."""
        x = self.preprocessing.normalise(pixels.float())
        batch = np.ascontiguousarray(x.detach().cpu().numpy(), dtype=self._dtype)
        return torch.from_numpy(self._run(batch)).to(pixels.device)

    def embed_uint8(self, images: np.ndarray) -> np.ndarray:
        """uint8 (N, C, H, W) -> embeddings: what ``inference.embed`` calls. The scaling runs
        inside onnxruntime (``pixels_session``: the graph with a uint8 input and its scaling
        in front), else in numpy in place."""
        if self.pixels_session is not None:
            out = self.pixels_session.run([self.output_name], {PIXELS_INPUT: np.ascontiguousarray(images)})[0]
            return self._vectors(out)
        batch: np.ndarray = np.asarray(images, dtype=self._dtype)  # one copy: uint8 -> float, C-contiguous
        batch *= self._scale
        batch += self._shift
        return self._run(batch)

    def _run(self, batch: np.ndarray) -> np.ndarray:
        return self._vectors(self.session.run([self.output_name], {self.input_name: batch})[0])

    def _vectors(self, out) -> np.ndarray:
        out = np.asarray(out, dtype=np.float32)
        if out.ndim < 2 or int(np.prod(out.shape[2:], dtype=np.int64)) != 1:
            # a graph's output is taken as it is: a feature map or token sequence is not an embedding
            raise ModelSourceError(f"the ONNX output {self.output_name!r} has shape {out.shape} for {len(out)} images; it "
                                   f"must be one vector per image, ({len(out)}, d): export the pooled embedding, or "
                                   f"name another output with --output")
        return out.reshape(len(out), -1)

    def __getstate__(self):  # a session does not pickle; Prefect never needs to
        raise TypeError("an ONNX embedder is not picklable")


PIXELS_INPUT = "fastfill_pixels"


def with_pixel_input(graph: bytes, input_name: str, scale: np.ndarray, shift: np.ndarray) -> bytes | None:
    """The graph with a uint8 input (``PIXELS_INPUT``) that it casts, scales and shifts into its
    own input, so onnxruntime does the scaling with its threads; None where the graph cannot be
    rewritten (the numpy scaling serves then)."""
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper

        model = onnx.load_from_string(graph)
        original = next(i for i in model.graph.input if i.name == input_name)
        element = original.type.tensor_type.elem_type
        pixels = onnx.ValueInfoProto()
        pixels.CopyFrom(original)
        pixels.name = PIXELS_INPUT
        pixels.type.tensor_type.elem_type = TensorProto.UINT8
        dtype = np.float16 if element == TensorProto.FLOAT16 else np.float32
        names = ("fastfill_as_float", "fastfill_scaled", "fastfill_scale", "fastfill_shift")
        nodes = [helper.make_node("Cast", [PIXELS_INPUT], [names[0]], to=element),
                 helper.make_node("Mul", [names[0], names[2]], [names[1]]),
                 helper.make_node("Add", [names[1], names[3]], [input_name])]
        model.graph.initializer.extend([numpy_helper.from_array(scale.astype(dtype), names[2]),
                                        numpy_helper.from_array(shift.astype(dtype), names[3])])
        kept = [i for i in model.graph.input if i.name != input_name]
        del model.graph.input[:]
        model.graph.input.extend([pixels, *kept])
        for position, node in enumerate(nodes):
            model.graph.node.insert(position, node)
        return model.SerializeToString()
    except Exception:  # noqa: BLE001 - an unusual graph keeps the plain path
        return None


def check_onnx_input(shape, preprocessing: Preprocessing) -> None:
    """The graph's declared input (N, C, H, W), where its sizes are fixed, must match the
    preprocessing's."""
    if len(shape) != 4:
        raise ModelSourceError(f"the ONNX graph's input has {len(shape)} dimensions {shape}; it must take images "
                               "(N, C, H, W)")
    fixed = [(name, want, got) for name, want, got in zip(("channels", "height", "width"), preprocessing.shape,
                                                          shape[1:]) if isinstance(got, int) and got != want]
    if fixed:
        said = ", ".join(f"{name} {got}" for name, _want, got in fixed)
        raise ModelSourceError(f"the ONNX graph takes images of {shape[1:]} ({said}), but the preprocessing gives "
                               f"{preprocessing.shape}: set --channels/--size to the graph's input")


def onnx_session(graph: bytes, threads: int | None = None):
    """An onnxruntime session over the graph: the CUDA provider when onnxruntime has it and a GPU
    is there, else the CPU with ``threads`` intra-op threads (default: torch's)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    providers = ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available():
        providers.insert(0, "CUDAExecutionProvider")
    try:
        return ort.InferenceSession(graph, sess_options=options, providers=providers)
    except Exception as error:  # noqa: BLE001 - onnxruntime's own exception types, said in one line
        raise ModelSourceError(f"not an ONNX graph onnxruntime can run: {str(error).splitlines()[0][:300]}") from error
