from services.common.model_main import main
from services.target.server import TargetServicer, register

DEFAULT_PORT = 50053

if __name__ == "__main__":
    main("target", DEFAULT_PORT, TargetServicer, register)
