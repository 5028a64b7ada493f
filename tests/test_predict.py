"""course_lib.predict: a prediction is locked in by its button and shown beside the answer."""

from course_lib.predict import Prediction


def test_a_prediction_is_locked_in_and_revealed_beside_the_answer():
    guess = Prediction("p = 8, m = 8: bubble?", unit="%")
    assert guess.reveal(46.7, "the formula") == ("the formula: 46.7 % (no prediction locked in above: make one "
                                                  "next time first)")
    guess.box.value = 20
    guess.button.click()
    assert guess.guess == 20 and guess.box.disabled and "Locked in: 20 %" in guess.note.value
    assert guess.reveal(46.7, "the formula") == "you predicted 20 %; the formula: 46.7 % (+26.7)"
    assert repr(guess) == "Predict first: p = 8, m = 8: bubble? (run this cell to answer)"
