"""The networks: 3DGAN in PyTorch (``gan3d``) and Keras 3 (``gan3d_keras``) with the constants
and f(E') both share (``gan3d_spec``, framework-free), and ResNet-50 in PyTorch (``resnet``;
the Keras ResNet-50 is ``keras.applications.ResNet50``)."""
