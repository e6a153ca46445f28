from services.common.model_main import main
from services.draft.server import DraftServicer, register

DEFAULT_PORT = 50052

if __name__ == "__main__":
    main("draft", DEFAULT_PORT, DraftServicer, register)
